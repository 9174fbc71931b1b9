"""``python -m facegate`` = the ``facegate`` command."""

from facegate.cli import main

main()
