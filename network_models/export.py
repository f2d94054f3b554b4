"""``python -m network_models.export``: export folds to TorchScript (builder.torchscript_cli)."""

import sys

from nnunet_triton.builder.torchscript_cli import main

if __name__ == "__main__":
    sys.exit(main())
