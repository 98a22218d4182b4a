"""The built-in web page (issue 46) in a real headless Chromium (Debian's `chromium`, driven by
Playwright's Python client): it chats like the API, stops the server's work, keeps
conversations over a reload, sends the sampler picked in it, follows plugin reloads and
quarantines live, and asks for the API key. Screenshots go to target/ui-screenshots/."""
import os
import re
import shutil
import subprocess
import time

import httpx
import pytest

from conftest import ROOT, Server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = os.path.join(ROOT, "target", "ui-screenshots")
BINARY = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
SCRIPTED = open(os.path.join(ROOT, "examples", "wat", "scripted.wat")).read()
TRAP = """(module
  (@custom "host.plugin" "{\\"abi\\": 1, \\"name\\": \\"trap-sample\\", \\"version\\": \\"0.1.0\\", \\"kinds\\": [\\"sampler\\"]}")
  (memory (export "memory") 2)
  (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "sampler_sample") (param i32 i32 i32) (result i32) unreachable))"""


def build(dest, wat_text):
    src = dest.with_suffix(".wat")
    src.write_text(wat_text)
    subprocess.run([BINARY, "plugins", "build-wat", str(src), str(dest)], check=True)
    src.unlink()


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is needed (Debian: apt-get install chromium; scripts/test.sh installs it)")
    from playwright.sync_api import sync_playwright

    os.makedirs(SHOTS, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = tmp_path_factory.mktemp("ui-plugins")
    build(d / "scripted.wasm", SCRIPTED)
    build(d / "trap-sample.wasm", TRAP)
    return d


@pytest.fixture(scope="module")
def server(live):
    s = Server("--plugins", str(live))
    yield s
    s.stop()


class Page:
    """A page of the server open in the browser, recording console errors and every URL it
    requests."""

    def __init__(self, browser, url):
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.errors, self.urls = [], []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.urls.append(r.url))
        self.page.goto(url)

    def ready(self):
        self.page.wait_for_selector("body[data-ready=true]", timeout=15000)
        return self.page

    def close(self):
        self.context.close()


def settings(page, **values):
    if page.is_hidden("#settings"):
        page.click("#toggle-settings")
    for k, v in values.items():
        if k == "sampler":
            page.select_option("#sampler", v)
        else:
            page.fill(f"#{k}", str(v))


def metric(http, name):
    m = re.search(rf"^{name} (\S+)$", http.get("/metrics").text, re.M)
    return float(m.group(1)) if m else None


def plugin(http, name):
    return next(p for p in http.get("/v1/plugins").json()["data"] if p["name"] == name and p["state"] != "overridden")


def test_the_page_streams_the_apis_greedy_reply_and_keeps_it_over_a_reload(browser, server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        question = "Name three colors of the rainbow."
        want = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 20}).json()
        want_text = want["choices"][0]["message"]["content"]
        # Clients that do not ask for HTML keep the JSON root.
        assert http.get("/").json()["service"] == "host"

    view = Page(browser, server.url + "/")
    try:
        page = view.ready()
        settings(page, temperature=0, max_tokens=20)
        page.fill("#input", question)
        page.click("#send")
        reply = page.wait_for_selector(".message.assistant[data-state=done]", timeout=60000)
        assert reply.query_selector(".content").inner_text().strip() == want_text.strip()
        stats = reply.query_selector(".stats").inner_text()
        assert f"{want['usage']['completion_tokens']} generated tokens" in stats and "tok/s" in stats, stats
        page.screenshot(path=os.path.join(SHOTS, "chat.png"))
        # A conversation survives a reload (kept in the browser).
        page.reload()
        view.ready()
        assert page.inner_text(".message.user .content") == question
        assert page.inner_text(".message.assistant .content").strip() == want_text.strip()
        assert view.errors == [], view.errors
        origin = server.url.rstrip("/")
        assert all(u.startswith(origin + "/") for u in view.urls), [u for u in view.urls if not u.startswith(origin)]
        response = httpx.get(server.url + "/", headers={"Accept": "text/html"})
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    finally:
        view.close()


def test_the_sampler_picked_in_the_page_is_used_and_stop_ends_the_servers_work(browser, server):
    http = httpx.Client(base_url=server.url, timeout=120)
    calls = plugin(http, "scripted")["calls"]
    view = Page(browser, server.url + "/")
    try:
        page = view.ready()
        page.click("#new-chat")
        settings(page, max_tokens=5000)
        page.select_option("#sampler", "scripted")
        page.fill("#input", "What is the capital of France?")
        page.click("#send")
        # The scripted sampler forces " Paris." forever: only the stop button ends it.
        # (A selector, not wait_for_function: the page's CSP forbids evaluating strings.)
        page.wait_for_selector(".message.assistant .content:has-text('Paris. Paris.')", timeout=60000)
        assert metric(http, "host_requests_running") == 1
        page.click("#stop")
        page.wait_for_selector(".message.assistant[data-state=stopped]", timeout=10000)
        deadline = time.time() + 10
        while metric(http, "host_requests_running") != 0:
            assert time.time() < deadline, "the stopped request still runs on the server"
            time.sleep(0.1)
        assert plugin(http, "scripted")["calls"] > calls
        assert re.fullmatch(r"(\s*Paris\.)*\s*Paris\.?", page.inner_text(".message.assistant .content"))
    finally:
        view.close()
        http.close()


def test_the_console_shows_a_replaced_plugin_and_a_quarantine_live(browser, server, live, tmp_path):
    http = httpx.Client(base_url=server.url, timeout=120)
    view = Page(browser, server.url + "/#console")
    try:
        page = view.ready()
        row = "#plugins tr[data-name=scripted]"
        page.wait_for_selector(f"{row} td.version:text-is('1.0.0')", timeout=5000)
        # Replace the file with a new version: the console shows it without a reload.
        v2 = tmp_path / "scripted.wasm"
        build(v2, SCRIPTED.replace('\\"version\\": \\"1.0.0\\"', '\\"version\\": \\"2.0.0\\"'))
        start = time.time()
        shutil.copyfile(v2, live / "scripted.wasm")
        page.wait_for_selector(f"{row} td.version:text-is('2.0.0')", timeout=5000)
        assert time.time() - start < 2.0, f"the new version showed after {time.time() - start:.1f} s"
        # A plugin that keeps faulting is quarantined, and the console says so.
        for _ in range(3):
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "plugins": {"sampler": {"name": "trap-sample"}}})
            assert r.status_code >= 400
        start = time.time()
        page.wait_for_selector("#plugins tr[data-name=trap-sample][data-state=quarantined]", timeout=5000)
        assert time.time() - start < 2.0
        assert "s left" in page.inner_text("#plugins tr[data-name=trap-sample] td.quarantine")
        page.wait_for_selector("#gauge-running .gauge-value", timeout=5000)
        page.screenshot(path=os.path.join(SHOTS, "console.png"))
        assert view.errors == [], view.errors
    finally:
        view.close()
        http.close()


def test_with_an_api_key_the_page_asks_for_it_and_the_api_still_refuses_without(browser):
    s = Server("--api-key", "sesame")
    view = None
    try:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/").status_code == 401  # JSON clients still need the key
        view = Page(browser, s.url + "/")
        page = view.page
        page.wait_for_selector("#key-dialog[open]", timeout=15000)
        page.fill("#key", "sesame")
        page.click("#key-form button[type=submit]")
        view.ready()
        settings(page, temperature=0, max_tokens=4)
        page.fill("#input", "Hello")
        page.click("#send")
        page.wait_for_selector(".message.assistant[data-state=done]", timeout=60000)
        assert page.query_selector(".message.assistant .error") is None
        # The key stays in the tab's session storage, not in the conversations.
        stored = page.evaluate("JSON.stringify(localStorage)")
        assert "sesame" not in stored
        assert httpx.post(s.url + "/v1/chat/completions", json={"messages": []}).status_code == 401
    finally:
        if view:
            view.close()
        s.stop()


def test_edit_and_regenerate_export_and_import_and_a_reply_is_escaped(browser, server, tmp_path):
    view = Page(browser, server.url + "/")
    try:
        page = view.ready()
        page.on("dialog", lambda d: d.accept())
        page.click("#new-chat")
        settings(page, temperature=0, max_tokens=8, sampler="")
        page.fill("#input", "Say one word.")
        page.click("#send")
        page.wait_for_selector(".message.assistant[data-state=done]", timeout=60000)
        # Edit the question: the reply after it is replaced by a new one.
        page.click(".message.user .edit")
        page.fill(".message.user .edit-text", "What is the capital of France?")
        page.click(".message.user .save-edit")
        page.wait_for_selector(".message.assistant[data-state=done]", timeout=60000)
        assert page.locator(".message").count() == 2
        assert page.inner_text(".message.user .content") == "What is the capital of France?"
        page.click("#title")
        page.fill("#title", "France")
        page.press("#title", "Enter")
        page.wait_for_selector("#conversations .conversation.active:text-is('France')")
        # Export, delete, import: the conversation comes back.
        with page.expect_download() as download:
            page.click("#export")
        saved = tmp_path / "conversations.json"
        download.value.save_as(saved)
        count = page.locator("#conversations li").count()
        page.click("#delete-chat")
        page.wait_for_selector("#conversations .conversation:text-is('France')", state="detached")
        page.set_input_files("#import", str(saved))
        page.wait_for_selector("#conversations .conversation:text-is('France')")
        assert page.locator("#conversations li").count() >= count
        # A constraint chosen in the settings holds the reply.
        page.click("#new-chat")
        page.select_option("#constraint-kind", "regex")
        page.fill("#constraint", "[0-9]{3}")
        page.fill("#input", "Pick a number.")
        page.click("#send")
        page.wait_for_selector(".message.assistant[data-state=done]", timeout=60000)
        assert re.fullmatch(r"[0-9]{3}", page.inner_text(".message.assistant .content").strip())
        # Model text is escaped before any tag is made: markup in a reply stays text.
        html = page.evaluate("""async () => {
            const md = await import('/ui/markdown.js');
            return md.render('<img src=x onerror=alert(1)> **bold** [x](javascript:alert(1))\\n```js\\nlet a = "<b>";\\n```');
        }""")
        assert "<img" not in html and "&lt;img" in html and "<strong>bold</strong>" in html, html
        assert "javascript:" not in html.replace("[x](javascript:alert(1))", ""), html
        assert 'href="javascript' not in html and "&lt;b&gt;" in html
        assert view.errors == [], view.errors
    finally:
        view.close()
