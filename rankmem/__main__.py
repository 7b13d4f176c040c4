"""``python -m rankmem`` is the ``rankmem`` command."""

from rankmem.cli import main

raise SystemExit(main())
