"""Former home of `replay-server`'s module, kept so that `python -m replay_service.serve` runs.

The tool lives in `replay_service.cli.serve`; kept paths are listed in `replay_service.__init__`.
"""

from replay_service.cli import serve as _serve
from replay_service.cli.serve import run

__all__ = ["run"]

if __name__ == "__main__":
    __doc__ = _serve.__doc__  # absl prints the main module's docstring as the usage text
    run()
