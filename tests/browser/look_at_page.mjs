// Open a page in headless Chromium and print what a reader would see, as JSON:
// node look_at_page.mjs file:///.../report.html screenshot.png
import chromium from "@sparticuz/chromium";
import puppeteer from "puppeteer-core";

const [url, screenshot] = process.argv.slice(2);
const browser = await puppeteer.launch({
  args: chromium.args,
  executablePath: await chromium.executablePath(),
  headless: true,
});
try {
  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  page.on("requestfailed", (r) => errors.push(`request failed: ${r.url().slice(0, 80)}`));
  await page.setViewport({ width: 1400, height: 1000 });
  const response = await page.goto(url, { waitUntil: "load" });
  const seen = await page.evaluate(() => ({
    title: document.title,
    summary: [...document.querySelectorAll("p.good, p.bad")].map((p) => p.innerText),
    rows: [...document.querySelectorAll("tr.pass, tr.fail")].map((r) => ({
      test: r.cells[0].innerText,
      verdict: r.cells[2].innerText,
      cls: r.className,
      color: getComputedStyle(r.cells[2]).color,
    })),
    images: [...document.images].map((i) => ({
      alt: i.alt,
      complete: i.complete,
      naturalWidth: i.naturalWidth,
      naturalHeight: i.naturalHeight,
      shownWidth: i.getBoundingClientRect().width,
    })),
  }));
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });
  console.log(JSON.stringify({ ok: response.ok(), browser: await browser.version(), errors, ...seen }));
} finally {
  await browser.close();
}
