"""``python -m repository.build``: build a Triton model repository (nnunet_triton.builder.repository_cli)."""

import sys

from nnunet_triton.builder.repository_cli import main

if __name__ == "__main__":
    sys.exit(main())
