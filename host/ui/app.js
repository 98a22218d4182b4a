// The page's entry: the API key when the server asks for one, the two views, and the start
// of the chat and the console.

import { Unauthorized, json, setKey } from "./api.js";
import * as chat from "./chat.js";
import * as console_ from "./console.js";

const $ = (id) => document.getElementById(id);

function showView(name) {
  for (const v of ["chat", "console"]) {
    $("view-" + v).hidden = v !== name;
    $("tab-" + v).classList.toggle("active", v === name);
  }
  location.hash = name === "chat" ? "" : "#" + name;
}

// Resolves once /v1/models answers, asking for the key as long as the server refuses it.
async function connect() {
  for (;;) {
    try {
      return await json("/v1/models");
    } catch (e) {
      if (!(e instanceof Unauthorized)) throw e;
      await askKey(e.message);
    }
  }
}

function askKey(message) {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-error").textContent = sessionStorage.getItem("host.apiKey") ? message : "";
    $("key").value = "";
    dialog.showModal();
    $("key-form").onsubmit = (e) => {
      e.preventDefault();
      setKey($("key").value.trim());
      dialog.close();
      resolve();
    };
  });
}

async function main() {
  for (const b of document.querySelectorAll("button.tab")) b.addEventListener("click", () => showView(b.dataset.view));
  const models = await connect();
  const info = (models.data && models.data[0]) || { id: "" };
  $("model-name").textContent = info.id;
  document.title = `host · ${info.id}`;
  chat.start(info.id);
  console_.start(info, chat.setPlugins);
  document.addEventListener("host-unauthorized", async () => {
    await askKey("the server refused the key");
    location.reload();
  });
  showView(location.hash === "#console" ? "console" : "chat");
  document.body.dataset.ready = "true";
}

main().catch((e) => {
  document.body.dataset.ready = "error";
  const p = document.createElement("p");
  p.className = "error fatal";
  p.textContent = "Could not reach the server: " + e.message;
  document.body.prepend(p);
});
