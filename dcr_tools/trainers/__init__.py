"""Reference Megatron trainers on CPU: a GPTModel builder (`model`) from the bridge's provider
settings (`providers`), a small policy-gradient trainer (`trainer`) and the RL trainer job that
serves the DCR owner service (`rl_job`)."""
