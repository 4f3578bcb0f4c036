import sys

from vlm_vit.cli import main

sys.exit(main())
