"""How learners read: PyTorch streams, priorities, n-step targets, rate limits."""
