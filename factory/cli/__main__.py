import sys

from factory.cli.app import main

sys.exit(main())
