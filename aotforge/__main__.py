import sys

from aotforge.cli import main

sys.exit(main())
