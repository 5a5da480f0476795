"""Where items live: one package per backend.

`reverb/`: a Reverb server, embedded in this process or reached by address.
`local/`: an in-process table for platforms without Reverb (no TensorFlow)."""
