"""Fill a starter replay buffer from a baseline policy, or copy one for a training run.

The same command as `replay-populate`; run it from the repository root, e.g.

  python scripts/populate_starter_buffer.py --buffer-name my-starter-buffer --capacity 50000 \
      --steps-per-run 672 --num-runs 10

and see `--help` for every flag.
"""

from replay_service.cli.populate import run

if __name__ == "__main__":
    run()
