"""The page at `/` in headless Chromium (Debian's chromium + chromedriver, never downloaded): type a
prompt, generate, pin one token and replace another, regenerate, and check both survive."""

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import serving


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
    driver.execute_script("document.getElementById('stats').textContent = ''")
    driver.find_element(By.ID, button).click()
    WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "stats").text
                                    or d.find_element(By.ID, "error").text)
    assert driver.find_element(By.ID, "error").text == ""


def test_generate_pin_edit_regenerate(browser, page):
    browser.get(page + "/")
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#method option"))
    browser.find_element(By.ID, "prompt").send_keys("And the LORD said unto Moses")
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("12")
    generate(browser, "generate")
    first = tokens(browser)
    stats = browser.find_element(By.ID, "stats").text
    assert len(first) == 12 and "tokens/s" in stats and "AR passes 12" in stats

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
