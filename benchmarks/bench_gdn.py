"""GDN forward beside FLA and FlashQLA on one GPU: see qla_compiler/bench.py (also `qla-bench`)."""
import sys

from qla_compiler.bench import main

if __name__ == "__main__":
    sys.exit(main())
