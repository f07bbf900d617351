"""``python -m vllm_specstream.cli``: the ``specstream`` command."""

import sys

from vllm_specstream.cli import main

sys.exit(main())
