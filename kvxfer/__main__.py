"""``python -m kvxfer``: the ``kvxfer`` command, for environments without its console script on PATH."""

from kvxfer.cli import main

main()
