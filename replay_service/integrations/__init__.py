"""Other libraries' interfaces: Stable-Baselines3's replay buffer."""
