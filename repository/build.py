"""``python -m repository.build``: build a Triton model repository (see nnunet_triton.builder.repository)."""

import sys

from nnunet_triton.builder.repository import main

if __name__ == "__main__":
    sys.exit(main())
