"""`python -m leantune <verb> ...`: what torchrun and accelerate launch run on every process.

`python -m` puts the working folder first on the import path. A folder named `leantune` there
without an `__init__.py` (an output folder, say) then becomes the package `leantune` (a namespace
package) ahead of an editable install, whose finder only answers after the path is searched: the
submodules are still found, so a run goes a long way before `from leantune import __version__`
fails with an ImportError. It is detected here, before anything else is imported, and named.
"""

import sys
from pathlib import Path


def shadowing_folders() -> list[str]:
    """The folders that stand in for this package as `leantune` (empty when it is itself)."""
    package = sys.modules.get("leantune")
    if package is None or getattr(package, "__file__", None) is not None:
        return []       # the real package (its __init__.py ran), or a copy with its own __init__.py
    here = Path(__file__).resolve().parent
    return [p for p in getattr(package, "__path__", []) if Path(p).resolve() != here]


if __name__ == "__main__":
    shadows = shadowing_folders()
    if shadows:
        print(f"leantune: the folder {shadows[0]} shadows the leantune package ({Path(__file__).resolve().parent}): "
              f"`python -m leantune` imports a folder of that name in the working folder first; run it from "
              f"another folder (or rename that folder)", file=sys.stderr)
        sys.exit(2)
    from leantune.cli import main

    sys.exit(main())
