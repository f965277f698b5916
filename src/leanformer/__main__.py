"""``python -m leanformer``: the same as the ``leanformer`` command."""

from leanformer.cli import main

raise SystemExit(main())
