"""For spare tests: exits as `sys.exit(VALUE)` with VALUE the Python literal in argv[1], after printing its argv."""

import ast
import sys

print("argv", sys.argv[1:], flush=True)
sys.exit(ast.literal_eval(sys.argv[1]))
