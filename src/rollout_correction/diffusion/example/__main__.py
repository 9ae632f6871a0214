from rollout_correction.diffusion.example.cli import main

raise SystemExit(main())
