"""A local SparkSession bound to loopback, for demos, tests and benchmarks on one machine."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

#: Spark settings every local session gets: loopback only, no UI, a quick JVM start.
LOOPBACK_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.extraJavaOptions": "-XX:+UseSerialGC -XX:TieredStopAtLevel=1",
}


def local_session(master: str = "local[2]", app: str = "timely", conf: Mapping[str, str] | None = None,
                  python_path: str | None = None, register: bool = True) -> Any:
    """A ``SparkSession`` on ``master`` that listens only on 127.0.0.1, logging at ERROR, with
    ``format("timely")`` registered (unless ``register`` is false: ``pyspark_timely`` on the Python
    path registers it by itself).

    Sets ``SPARK_LOCAL_IP=127.0.0.1`` (otherwise Spark binds the machine's outward interface) and
    makes Spark's Python workers run this interpreter; ``python_path`` is put first on their
    ``PYTHONPATH`` (a source checkout, so that they find ``spark_bridge``). ``conf`` adds or
    overrides settings of :data:`LOOPBACK_CONF`.
    """
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    if python_path:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (python_path, os.environ.get("PYTHONPATH")) if p)
    from pyspark.sql import SparkSession

    from . import datasource

    builder = SparkSession.builder.master(master).appName(app)
    for key, value in {**LOOPBACK_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if register:
        datasource.register(spark)
    return spark
