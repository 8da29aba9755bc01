"""mlxcel.shared: values and protocol shared by the daemon and the console.

Imports neither mlx nor textual (a test proves it).
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
