"""The store node: one CPU memory segment cut into block-sized slots, served over UCX (data) and gRPC
(control). The master allocates slots; the store enforces generations, checksums and deferred frees.
"""

from kvpool.store.segment import Segment
from kvpool.store.settings import StoreSettings, parse_size
from kvpool.store.slots import SlotState, SlotTable

__all__ = ["Segment", "SlotState", "SlotTable", "StoreSettings", "parse_size"]
