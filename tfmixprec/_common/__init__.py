"""What every part of tfmixprec shares: host copies of arrays, the callbacks' cadence, the
formats' limits, report text, argument checks, walking a model's layers and observing
one call. Private: nothing here is public API.
"""

__all__: list[str] = []
