"""grpo-launcher's Hydra plugins: the `grpo` launcher (validate every point, then run or submit each)
and the `optuna` sweeper (optuna ≥ 4, persistent study). Discovered by Hydra through `hydra_plugins`."""
