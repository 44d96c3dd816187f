import sys

from r3arrow.cli import main

sys.exit(main())
