// Small enhancements; every page works without them.
// "Copy" buttons: <button data-copy="#id"> copies the text of the element #id.
document.addEventListener("click", function (event) {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const source = document.querySelector(button.dataset.copy);
  if (!source || !navigator.clipboard) return;
  navigator.clipboard.writeText(source.textContent.trim()).then(function () {
    const label = button.textContent;
    button.textContent = "Copied";
    setTimeout(function () { button.textContent = label; }, 1500);
  });
});
// Copy buttons are useless without a clipboard (or without this script): show them only here.
function revealCopyButtons(root) {
  if (!navigator.clipboard) return;
  root.querySelectorAll("button[data-copy][hidden]").forEach(function (b) { b.hidden = false; });
}
document.addEventListener("DOMContentLoaded", function () { revealCopyButtons(document); });
document.addEventListener("htmx:afterSettle", function (event) { revealCopyButtons(event.target); });
