"""Automatic registration of ``format("timely")``: Spark imports every top-level ``pyspark_*``
module on its Python workers' path and registers its ``DefaultSource``."""
from spark_bridge.datasource import TimelyDataSource as DefaultSource

__all__ = ["DefaultSource"]
