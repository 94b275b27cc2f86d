"""Every use of Keras's internals (`keras.src`, private attributes and hooks), one module a
concern patched, each use with its reason; and the registry every change to a layer or
model instance goes through (`patches`). Private: nothing here is public API.
"""

__all__: list[str] = []
