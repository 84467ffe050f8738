"""The dashboard (timely.dashboard) in a real browser: headless Chromium (Debian's chromium and
chromium-driver, driven by selenium) loads the page of a running two-worker job, sees live numbers
change, starts a rebalance and sees the bin map change; a malformed request is refused with a
clear error and the job runs on, with outputs equal to the sequential count."""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest

import megaphone
import timely
from timely.metrics import ENV, MetricsConfig

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - the test extra installs it
    webdriver = None

K = 4
EPOCH_S = 0.02
KEYS = list(range(40))


def count_fold(key, value, state):
    n = (state or 0) + value
    return n, [(key, n)]


def dashboard_job(worker: timely.Worker):
    """A paced keyed count that runs until the file ``stop`` appears in ``worker.args[0]``; worker 0
    writes its dashboard's port to ``port`` there."""
    folder = worker.args[0]
    with worker.dataflow() as scope:
        data = scope.new_input()
        control = megaphone.ControlInput(scope, k=K)
        m = megaphone.state_machine(data.stream, control, 0, count_fold, name="Count")
        outputs: list = []
        m.stream.inspect(outputs.append)
    start = time.time()
    worker.metrics.track("Count", m.probe, wall_of=lambda t: start + t * EPOCH_S)
    controller = megaphone.Controller(control, m.probe) if worker.index == 0 else None
    if worker.index == 0:
        with open(os.path.join(folder, "port.tmp"), "w") as f:
            f.write(str(worker.metrics.dashboard.port))
        os.replace(os.path.join(folder, "port.tmp"), os.path.join(folder, "port"))
    epochs = 0
    deadline = time.monotonic() + 100
    while not os.path.exists(os.path.join(folder, "stop")) and time.monotonic() < deadline:
        if worker.index == 0:
            data.send_batch([(k, 1) for k in KEYS])
        epochs += 1
        data.advance_to(epochs)
        control.advance_to(epochs)
        if controller is not None:
            controller.tick()
        worker.step_while(lambda: m.probe.less_than(epochs - 2), timeout=30)
        time.sleep(EPOCH_S)
    data.close()
    control.close()
    while controller is not None and controller.busy:
        controller.tick()
        worker.step_or_park(0.01)
    worker.step_while(lambda: not m.probe.done(), timeout=30)
    return outputs, epochs, (tuple(controller.current_table) if controller is not None else None)


needs_browser = pytest.mark.skipif(webdriver is None or not CHROMIUM or not DRIVER,
                                   reason="needs selenium and Debian's chromium and chromium-driver "
                                          "(apt-get install chromium chromium-driver)")


def text_int(driver, element_id: str) -> int:
    return int(driver.find_element(By.ID, element_id).text.replace(",", "") or 0)


@needs_browser
def test_dashboard_in_a_browser(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, MetricsConfig(hub=f"ipc://{tmp_path}/hub", interval=0.1, dashboard=0).to_env())
    results: list = []
    errors: list = []

    def run() -> None:
        try:
            results.append(timely.execute(dashboard_job, workers=2, args=[str(tmp_path)], timeout=150))
        except BaseException as e:  # reported by the test
            errors.append(e)

    job = threading.Thread(target=run)
    job.start()
    driver = None
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "port").exists():
            assert not errors and time.monotonic() < deadline, f"the job did not start its dashboard: {errors}"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{(tmp_path / 'port').read_text()}/"
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(DRIVER), options=options)
        driver.get(url)
        wait = WebDriverWait(driver, 30, poll_frequency=0.1)
        # Live numbers change.
        wait.until(lambda d: text_int(d, "records-total") > 0)
        first = text_int(driver, "records-total")
        wait.until(lambda d: text_int(d, "records-total") > first)
        assert driver.find_element(By.ID, "status").text.startswith("live")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#bins .bin")) == 1 << K)
        assert "Count" in driver.find_element(By.ID, "graph").get_attribute("innerHTML")
        # A malformed request is refused with a clear error; nothing moves.
        driver.find_element(By.ID, "moves").send_keys("x:y")
        driver.find_element(By.ID, "rebalance-moves").click()
        wait.until(lambda d: "refused" in d.find_element(By.ID, "rebalance-result").text)
        assert "pairs of integers" in driver.find_element(By.ID, "rebalance-result").text
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url + "api/rebalance", data=b"not json", method="POST",
                                                          headers={"Content-Type": "application/json"}), timeout=10)
        assert refused.value.code == 400 and "JSON object" in json.loads(refused.value.read())["error"]
        # A rebalance from the page: bin 0 moves to the other worker, and the map shows it.
        cell = driver.find_element(By.CSS_SELECTOR, '#bins .bin[data-bin="0"]')
        owner = int(cell.get_attribute("data-owner"))
        driver.find_element(By.ID, "moves").clear()
        driver.find_element(By.ID, "moves").send_keys(f"0:{1 - owner}")
        driver.find_element(By.ID, "rebalance-moves").click()
        wait.until(lambda d: "started" in d.find_element(By.ID, "rebalance-result").text)
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, '#bins .bin[data-bin="0"]').get_attribute("data-owner")
                   == str(1 - owner))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#steps tr[data-state="completed"]'))
        # The job ran on.
        later = text_int(driver, "records-total")
        wait.until(lambda d: text_int(d, "records-total") > later)
        shot = os.environ.get("TIMELY_DASHBOARD_SCREENSHOT")  # the README's picture: make it here
        if shot:
            driver.set_window_size(1400, 1100)
            time.sleep(2)  # a few more refreshes of the charts
            driver.save_screenshot(shot)
    finally:
        if driver is not None:
            driver.quit()
        (tmp_path / "stop").touch()
        job.join(timeout=120)
    assert not job.is_alive() and not errors, errors
    (out0, epochs0, table), (out1, epochs1, _) = results[0]
    assert table is not None and table[0] == 1 - owner
    # The outputs are the sequential count's: every key's running totals 1..n, each once.
    sent = epochs0  # worker 0 sent one batch per epoch
    assert Counter(out0 + out1) == Counter((k, n) for k in KEYS for n in range(1, sent + 1))


def api(url: str, body: dict | bytes | None = None, host: str | None = None) -> tuple[int, dict]:
    """GET (or POST ``body``) a dashboard API URL: ``(status, decoded reply)``."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=15) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "condition still false"
        time.sleep(0.1)


def test_dashboard_api(tmp_path, monkeypatch):
    """The page's API without a browser: live state, a rebalance, refusals; outputs unchanged."""
    monkeypatch.setenv(ENV, MetricsConfig(hub=f"ipc://{tmp_path}/hub", interval=0.1, dashboard=0).to_env())
    results: list = []
    job = threading.Thread(target=lambda: results.append(
        timely.execute(dashboard_job, workers=2, args=[str(tmp_path)], timeout=150)))
    job.start()
    try:
        wait_for(lambda: (tmp_path / "port").exists(), 60)
        url = f"http://127.0.0.1:{(tmp_path / 'port').read_text()}/"
        assert b"Chart" in urllib.request.urlopen(url + "static/chart.min.js", timeout=10).read(200)
        for _ in range(3):  # clients that leave mid-download (a closed tab) do not end the job
            with socket.create_connection(("127.0.0.1", int((tmp_path / "port").read_text())), timeout=10) as c:
                c.sendall(b"GET /static/chart.min.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                # and close before the reply: the server's writes after the first one fail (EPIPE)

        def applied() -> int:
            state = api(url + "api/state")[1]
            return sum(o["records_in"] for o in state["operators"] if o["operator"] == "Count")

        first = wait_for(applied)
        wait_for(lambda: applied() > first)
        state = api(url + "api/state")[1]
        assert sorted(state["heard"]) == [0, 1] and state["steering"]["nbins"] == 1 << K
        assert any(p["probe"] == "Count" and p["lag_s"] is not None for p in state["lags"])
        owner = state["steering"]["table"][3]
        assert api(url + "api/rebalance", {"moves": [[3, "x"]]})[0] == 400
        status, reply = api(url + "api/rebalance", {"moves": [[99, 0]]})
        assert status == 400 and "99" in reply["error"]
        assert api(url + "api/rebalance", {"balanced": True, "strategy": "nope"})[1]["error"].startswith("unknown strategy")
        assert api(url + "api/rebalance", b"[1, 2]")[0] == 400
        # Deep nesting (a RecursionError, not a ValueError) is a 400 with its reason, not an HTML 500;
        # moves beyond any job's bins are refused before they reach worker 0's thread.
        status, reply = api(url + "api/rebalance", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        assert status == 400 and reply["error"] == "the request must be a JSON object"
        status, reply = api(url + "api/rebalance", {"moves": [[0, 0]] * ((1 << 16) + 1)})
        assert status == 400 and "moves has 65537 entries: a job has at most 65536 bins" in reply["error"]
        assert api(url + "api/state", host="attacker.example")[0] == 403
        status, reply = api(url + "api/rebalance", {"moves": [[3, 1 - owner]], "strategy": "fluid"})
        assert status == 200 and reply["ok"] and reply["moves"] == 1
        wait_for(lambda: api(url + "api/state")[1]["steering"]["table"][3] == 1 - owner)
        wait_for(lambda: any(s["state"] == "completed" for s in api(url + "api/state")[1]["steering"]["steps"]))
        later = applied()
        wait_for(lambda: applied() > later)
    finally:
        (tmp_path / "stop").touch()
        job.join(timeout=120)
    assert not job.is_alive() and results
    (out0, epochs0, table), (out1, _, _) = results[0]
    assert table is not None and table[3] == 1 - owner
    assert Counter(out0 + out1) == Counter((k, n) for k in KEYS for n in range(1, epochs0 + 1))


def test_a_dashboard_port_in_use_is_named_with_its_reason(capfd):
    from timely.dashboard import Dashboard

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"the dashboard cannot listen on 127.0.0.1:{port}: Address already in use$"):
            Dashboard(metrics=None, port=port)
    assert "Port" not in capfd.readouterr().err  # (werkzeug's own advice is not printed)
