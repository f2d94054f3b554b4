"""``python -m network_models.export``: export folds to TorchScript (nnunet_triton.cli.export)."""

import sys

from nnunet_triton.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
