"""``python -m training run RECIPE --out DIR`` trains a draft head end to end (data -> optional
self-distillation -> online features -> training -> validation tau -> export);
``python -m training data prepare ...`` builds a conversation file (see training/data.py);
``python -m training finetune RECIPE --out DIR`` fine-tunes a target (training/finetune.py);
``python -m training draft-model --target DIR --layers K --out DIR`` builds a draft LM (training/draft_model.py).

The command line lives in training/cli.py; this module imports it inside ``main``, so that a Ctrl-C while
torch and transformers load ends with one line too."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """training.cli's main; a Ctrl-C at any moment prints "interrupted" and returns 130, a device out of
    memory one line and fsd_eagle.errors.OUT_OF_MEMORY_STATUS."""
    try:
        from .cli import main as cli_main

        return cli_main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, MemoryError) as e:
        from fsd_eagle.errors import exit_out_of_memory

        return exit_out_of_memory(e, "train with fewer tokens per batch (the recipe's tokens_per_batch) or fewer "
                                     "processes on this device, then rerun with --resume")


if __name__ == "__main__":
    from fsd_eagle.cli import exit_with

    exit_with(main())
