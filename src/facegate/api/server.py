"""``facegate serve``: plan, then serve in one process or as a supervisor of engines and front-ends."""

from __future__ import annotations

import logging
import sys

from facegate.api.app import create_app, uvicorn_config
from facegate.api.drain import exit_quietly_on_sigterm
from facegate.api.state import get_state
from facegate.config import Settings
from facegate.transport.remote import SWITCH_INTERVAL_S
from facegate.tuning import make_plan

log = logging.getLogger(__name__)


def run(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM, in one process or with the process model, as the serving plan (logged in one
    line) says. A failed load shuts the server down and raises its FacegateError here, so a misconfigured server
    does not linger unready."""
    import uvicorn

    from facegate.api.security import check_bind
    from facegate.service.keys import KeyStore

    if not logging.getLogger().handlers:
        from facegate.logs import configure_logging

        configure_logging()
    exit_quietly_on_sigterm()
    check_bind(settings, KeyStore.for_data_dir(settings.data_dir, settings.security.keys_file))
    plan = make_plan(settings)
    log.info("%s", plan.summary())
    if plan.workers > 1 or plan.engines > 1:
        from facegate.api.multiprocess import run_multiprocess

        return run_multiprocess(settings, plan)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(settings, plan=plan)
    server = uvicorn.Server(uvicorn_config(app, settings))
    state = get_state(app)
    state.on_load_error = lambda exc: setattr(server, "should_exit", True)
    log.info("facegate listening on http://%s:%d (docs at /docs)", settings.host, settings.port)
    server.run()
    if state.load_error is not None:
        raise state.load_error
