"""The page at `/` in headless Chromium (Debian's chromium + chromedriver, never downloaded): type a
prompt, generate, pin one token and replace another, regenerate, and check both survive; every token marked
by who the server says wrote it, live speed while streaming, and DD2's canvas step by step."""

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import ROOT, serving


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(tiny_run):
    with serving(tiny_run) as url:
        yield url


def tokens(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#output .token")


def generate(driver, button: str):
    """Click `button` and wait for the generation to end (the stats line is also written while it streams)."""
    driver.execute_script("document.getElementById('stats').textContent = ''")
    driver.find_element(By.ID, button).click()
    WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "generate").is_enabled()
                                    and (d.find_element(By.ID, "stats").text or d.find_element(By.ID, "error").text))
    assert driver.find_element(By.ID, "error").text == ""


def origins(driver) -> list[str]:
    return [t.get_attribute("data-origin") for t in tokens(driver)]


def open_page(driver, url: str, prompt: str, max_tokens: int):
    driver.get(url + "/")
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#method option"))
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "max-tokens").clear()
    driver.find_element(By.ID, "max-tokens").send_keys(str(max_tokens))


def test_generate_pin_edit_regenerate(browser, page):
    open_page(browser, page, "And the LORD said unto Moses", 12)
    generate(browser, "generate")
    first = tokens(browser)
    stats = browser.find_element(By.ID, "stats").text
    assert len(first) == 12 and "tokens/s" in stats and "AR passes 12" in stats and "tau 1.00" in stats
    assert origins(browser) == ["ar"] * 12 and all("from-ar" in t.get_attribute("class") for t in first)

    pinned_title = first[9].get_attribute("title")
    first[9].click()  # pin position 9
    assert "pinned" in first[9].get_attribute("class")
    ActionChains(browser).double_click(first[2]).perform()  # replace position 2 (the text may span tokens)
    alert = WebDriverWait(browser, 10).until(lambda d: d.switch_to.alert)
    alert.send_keys(" Zebra")
    alert.accept()
    assert first[2].text.strip() == "Zebra" and "edited" in first[2].get_attribute("class")

    temperature = browser.find_element(By.ID, "temperature")
    temperature.clear()
    temperature.send_keys("1.5")  # sampling: without pins the text would change
    generate(browser, "regenerate")
    after = tokens(browser)
    assert len(after) > 9 and after[9].get_attribute("title") == pinned_title  # same position, same token id
    server_text = browser.execute_script("return tokens.map(t => t.text).join('')")  # what the server sent
    assert " Zebra" in server_text and "pinned" in after[2].get_attribute("class")  # now pinned by id
    assert origins(browser)[9] == origins(browser)[2] == "pinned"  # the server says so, and the page shows it
    assert {"pinned", "from-pinned"} <= set(after[9].get_attribute("class").split())


@pytest.fixture(scope="module")
def refusion_page():
    with serving(ROOT / "checkpoints" / "refusion-kjv2web") as url:
        yield url


def test_refusion_tokens_show_who_wrote_them(browser, refusion_page):
    """Each token is marked as the server's origins say (the shipped ReFusion model: its AR stream accepts
    most of its diffusion stream's drafts), the stats line counts tokens/s and tau while the text streams,
    and a pinned draft keeps its pin, and is then reported as pinned."""
    prompt = "And God said, Let there be light: and there was light."
    open_page(browser, refusion_page, prompt, 40)
    browser.find_element(By.ID, "method").send_keys("refusion")
    browser.execute_script("window.seen = []; new MutationObserver((records) => records.forEach("  # every line set
                           "(r) => r.addedNodes.forEach((n) => seen.push(n.textContent)))).observe($('stats'), "
                           "{childList: true})")
    generate(browser, "generate")
    reply = httpx.post(refusion_page + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 40, "temperature": 0}).json()["diffar"]
    said = reply["origins"]
    assert origins(browser) == said and {"draft", "ar"} <= set(said)
    assert [t.get_attribute("class") for t in tokens(browser)] == [f"token from-{o}" for o in said]
    tau = len(said) / said.count("ar")
    assert f"tau {tau:.2f} tokens/AR pass" in browser.find_element(By.ID, "stats").text
    streamed = browser.execute_script("return seen")[:-1]  # before the final line
    assert any("tokens/s" in line and "tau" in line for line in streamed)

    drafted = said.index("draft")
    tokens(browser)[drafted].click()
    generate(browser, "regenerate")
    marked = tokens(browser)[drafted]
    assert origins(browser)[drafted] == "pinned" and "pinned" in marked.get_attribute("class").split()
    assert marked.get_attribute("title") == f"position {drafted}, token {reply['token_ids'][drafted]}"


@pytest.fixture(scope="module")
def dd2_page(tiny_dd2):
    with serving(tiny_dd2 / "x0") as url:
        yield url


def test_dd2_steps_can_be_viewed_and_pinned_from(browser, dd2_page):
    """A multi-step DD2 generation shows its canvas after each step on a slider; moving it changes the canvas
    shown (the steps before the last are argmax read-outs, the last is sampled at the page's temperature: from
    an untrained decoder, other tokens), and a token pinned from an earlier step is kept by the next generation."""
    open_page(browser, dd2_page, "In the beginning God created the heaven and the earth.", 12)
    browser.find_element(By.ID, "method").send_keys("dd2")
    for field, value in (("steps", "4"), ("temperature", "1")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    generate(browser, "generate")
    slider = browser.find_element(By.ID, "step")
    assert browser.find_element(By.ID, "step-view").is_displayed() and slider.get_attribute("max") == "4"
    assert slider.get_attribute("value") == "4" and set(origins(browser)) == {"diffusion"}
    final = [t.text for t in tokens(browser)]
    slider.send_keys(Keys.HOME)
    assert slider.get_attribute("value") == "1" and "1 of 4" in browser.find_element(By.ID, "step-label").text
    first = tokens(browser)
    assert [t.text for t in first] != final
    position = next(i for i, t in enumerate(first) if i >= len(final) or t.text != final[i])
    pinned_id = first[position].get_attribute("title").rsplit(" ", 1)[1]
    first[position].click()
    assert "pinned" in first[position].get_attribute("class")
    generate(browser, "regenerate")
    kept = tokens(browser)[position]
    assert kept.get_attribute("title") == f"position {position}, token {pinned_id}"
    assert origins(browser)[position] == "pinned" and "pinned" in kept.get_attribute("class").split()


def test_a_drafter_s_domain_is_chosen_on_the_page(browser, page, domain_refusion):
    """A server whose diffusion stream has a domain adapter lists its domains; the page offers them and sends the
    one chosen (the server refuses a request without one), and hides the choice where there is none."""
    open_page(browser, page, "And God said", 4)
    assert not browser.find_element(By.ID, "domain").is_displayed()
    with serving(domain_refusion) as url:
        open_page(browser, url, "And God said, Let there be light: and there was light.", 12)
        browser.find_element(By.ID, "method").send_keys("refusion")
        WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "domain").is_displayed())
        choice = browser.find_element(By.ID, "domain")
        assert [o.text for o in choice.find_elements(By.TAG_NAME, "option")] == ["kjv2web", "web2rv"]
        choice.send_keys("web2rv")
        generate(browser, "generate")  # no error: the request named its domain
        assert tokens(browser)


@pytest.fixture(scope="module")
def chat_page(smollm2_checkpoint):
    with serving(smollm2_checkpoint) as url:
        yield url


def test_a_chat_model_answers_on_the_page(browser, chat_page):
    """With a chat model the page sends the prompt as a user message: the answer, not a continuation."""
    browser.get(chat_page + "/")
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#method option"))
    WebDriverWait(browser, 10).until(lambda d: d.execute_script("return chat"))
    browser.find_element(By.ID, "prompt").send_keys("What is the capital of France?")
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("16")
    generate(browser, "generate")
    assert "Paris" in browser.find_element(By.ID, "output").text
    assert "finish: stop" in browser.find_element(By.ID, "stats").text  # the end-of-turn token ended it


def test_a_server_with_an_api_key_asks_for_it(browser, tiny_run):
    with serving(tiny_run, "--api-key", "s3cret") as url:
        browser.get(url + "/")
        WebDriverWait(browser, 30).until(lambda d: "API key" in d.find_element(By.ID, "error").text)
        assert browser.find_element(By.ID, "api-key").is_displayed()
        browser.find_element(By.ID, "api-key").send_keys("s3cret\n")  # Enter commits the field (change)
        WebDriverWait(browser, 30).until(lambda d: not d.find_element(By.ID, "error").text)
        browser.find_element(By.ID, "prompt").send_keys("And God said")
        generate(browser, "generate")
        assert tokens(browser) and not browser.find_element(By.ID, "error").text
