"""Former home of `replay-demo`'s module, kept so that `python -m replay_service.demo` runs.

The tool lives in `replay_service.cli.demo`; `collect_data_spec` in `replay_service.specs.nests`.
"""

from replay_service.specs.nests import collect_data_spec

__all__ = ["collect_data_spec", "run"]


def run() -> None:
    """Runs `replay-demo` (its absl flags are defined only now, not on import)."""
    from replay_service.cli import demo

    demo.run()


if __name__ == "__main__":
    from replay_service.cli import demo as _demo

    __doc__ = _demo.__doc__  # absl prints the main module's docstring as the usage text
    run()
