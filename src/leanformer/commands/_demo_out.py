"""The output folder of a demo, which every demo run replaces.

A demo writes its runs with ``overwrite=True``: running it again replaces what the last
run wrote, as its ``--help`` says. That must not reach a folder the demo did not write
(``--out runs`` would replace ``runs/sret_digits``, a run ``leanformer train`` wrote and
protects). A demo marks its folder; a folder given by ``--out`` that holds anything and
no mark is refused. The demo's own default folder is its own even without the mark
(written by versions before it).
"""

from __future__ import annotations

from pathlib import Path

MARK = ".leanformer-demo"


def claim_demo_folder(folder: str | Path, demo: str, *, defaults: tuple[str, ...]) -> Path:
    """Refuse ``folder`` unless it is new, empty, a demo's, or one of the demo's ``defaults``
    (however spelled: ``./runs/demo_deit/`` is ``runs/demo_deit``); mark it. Returns it."""
    folder = Path(folder)
    mark = folder / MARK
    default = folder.resolve() in {Path(d).resolve() for d in defaults}
    if not default and folder.is_dir() and not mark.is_file() and any(folder.iterdir()):
        raise ValueError(
            f"--out {folder} holds files a demo did not write, and `leanformer demo {demo}` "
            "replaces its folder's runs on every run: give it a new or empty folder"
        )
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {folder} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    mark.write_text(f"written by `leanformer demo {demo}`, which replaces what it wrote here on every run\n")
    return folder
