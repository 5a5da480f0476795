"""Reverb's private formats and behaviour, one module per format or job.

Reverb does not document its checkpoint files or offer a way to stop a server from confirming
writes while it still answers its own process; replay_service relies on both. Everything that
depends on such private knowledge lives here, checked against the Reverb versions it was
verified on (`version.py`). `replay_service.backends.reverb.internals` is the one import
surface of these modules for the rest of the package.
"""
