import sys

from nvtp.cli import main

sys.exit(main())
