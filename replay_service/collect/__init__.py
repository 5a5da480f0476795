"""How items get in: TF-Agents observers, transition writers, gymnasium vector envs."""
