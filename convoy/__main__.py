import sys

from convoy.cli.main import main

sys.exit(main())
