import os
import sys

# Test this checkout's sources even when another checkout is pip-installed (e.g. git worktrees).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
