"""``python -m network_models.export``: export folds to TorchScript (nnunet_triton.builder.torchscript)."""

import sys

from nnunet_triton.builder.torchscript import main

if __name__ == "__main__":
    sys.exit(main())
