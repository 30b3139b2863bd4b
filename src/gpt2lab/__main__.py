import sys

from gpt2lab.cli import main

sys.exit(main())
