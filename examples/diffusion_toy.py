"""Toy FlowGRPO with a reduced-precision rollout engine, trained with and without rollout correction.

Same as ``python -m rollout_correction.diffusion.example``; see docs/diffusion.md.

    python examples/diffusion_toy.py --quick
    python examples/diffusion_toy.py --precision bf16 --seeds 0 1 2 3
"""

import sys

from rollout_correction.diffusion.example import main

if __name__ == "__main__":
    sys.exit(main())
