"""`python -m clover.integrations.lm_eval ...` = `clover-lm-eval ...` = `lm_eval ...` + "clover"."""

import sys

from clover.integrations.lm_eval.cli import main

sys.exit(main())
