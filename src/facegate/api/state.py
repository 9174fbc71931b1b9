"""The state an app's routes share, stored on ``app.state.facegate``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from facegate.config import Settings
from facegate.errors import EngineClosedError, FacegateError, GalleryUnavailableError
from facegate.metrics.stats import ServiceStats
from facegate.tuning import ServingPlan

if TYPE_CHECKING:
    from facegate.service.faces import FaceService
    from facegate.service.gallery import GalleryFront


@dataclass
class ServingState:
    """Everything the routes share. ``service`` and ``gallery`` are ``None`` until the lifespan made them;
    ``ready``: models warm and the engine running (the gallery may still be retried: ``gallery_error``);
    ``on_load_error``: called with ``load_error`` (``run`` shuts the server down)."""

    settings: Settings
    plan: ServingPlan
    service: FaceService | None = None
    gallery: GalleryFront | None = None
    stats: ServiceStats = field(default_factory=ServiceStats)
    decode_pool: ThreadPoolExecutor | None = None
    gallery_pool: ThreadPoolExecutor | None = None
    ready: bool = False
    load_error: FacegateError | None = None
    gallery_error: FacegateError | None = None
    gallery_task: asyncio.Task[None] | None = None
    owns_gallery: bool = False  # opened by the lifespan (then closed by it), not passed in
    service_started: bool = False
    load_task: asyncio.Task[None] | None = None
    on_load_error: Callable[[FacegateError], None] | None = None
    #: ``(socket path(s), authkey)`` of engine process(es) to use instead of loading models (front-end mode)
    engine: tuple[str | list[str], bytes] | None = None

    def require_service(self) -> FaceService:
        """The service, or raise the load error, else EngineClosedError (503)."""
        if self.ready and self.service is not None:
            return self.service
        if self.load_error is not None:
            raise self.load_error
        raise EngineClosedError("the service is starting: models are not loaded and warmed yet")

    def require_ready(self) -> tuple[FaceService, GalleryFront]:
        """The service and the gallery, or raise as :meth:`require_service`, or GalleryUnavailableError (503)."""
        service = self.require_service()
        if self.gallery is None:
            cause = self.gallery_error
            raise GalleryUnavailableError(
                "the gallery is unavailable (retrying): " + (cause.message if cause else "not open yet"),
                detail={"cause": cause.to_dict()} if cause else {},
            )
        return service, self.gallery

    async def in_decode_pool(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Await ``fn(*args, **kw)`` on a decode thread."""
        return await asyncio.get_running_loop().run_in_executor(self.decode_pool, lambda: fn(*args, **kw))

    async def in_gallery_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Await a gallery call on the gallery thread."""
        return await asyncio.get_running_loop().run_in_executor(self.gallery_pool, fn, *args)


def get_state(app: Any) -> ServingState:
    """The :class:`ServingState` of an app made by :func:`create_app`."""
    return app.state.facegate  # type: ignore[no-any-return]
