import sys

from moc.cli import main

sys.exit(main())
