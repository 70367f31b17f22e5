import sys

from tprt.cli.main import main

sys.exit(main())
