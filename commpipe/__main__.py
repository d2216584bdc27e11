import sys

from commpipe.cli import main

sys.exit(main())
