"""The parameter server: ``parameter_server`` builds it and is the workers' side (push, pull,
checkpoints), ``server`` the server ranks' loop that answers them under the staleness bound,
``protocol`` the tags, header kinds and server ranges both sides use."""
from .parameter_server import ParameterServer

__all__ = ["ParameterServer"]
