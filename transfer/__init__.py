"""Moving block bytes between nodes: the `Transport` protocol and its UCX and loopback implementations.

Depends on nothing in the project.
"""
