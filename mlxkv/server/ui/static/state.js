// What the page holds: conversations and settings kept in the browser's local storage, what it
// knows only while open (the served models, the reply running, the message being edited, the
// images attached), and the questions asked of them.

const CHATS_KEY = "mlxkv.chats.v1";
const SETTINGS_KEY = "mlxkv.settings.v1";

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

export const store = load(CHATS_KEY, { chats: [], current: null });
export const settings = { temperature: "", maxTokens: "512", apiKey: "", model: "", ...load(SETTINGS_KEY, {}) };
export const session = {
  // The chat models the server serves (GET v1/models, embedding models left out), the default
  // first; empty until known, when requests name no model and the server answers with its default.
  models: [],
  active: null, // the generation running: { chat, message, controller }
  editing: null, // the user message being edited: { chatId, index, draft }
  // Images pasted or dropped into the composer, as data: URLs, sent with the next message.
  attached: [],
};

// A reply that was streaming when the page closed ended there.
for (const chat of store.chats) {
  for (const m of chat.messages) {
    if (m.pending) Object.assign(m, { pending: false, stopped: true });
  }
}

export function save() {
  // Elements rendered for messages are not data.
  localStorage.setItem(CHATS_KEY, JSON.stringify(store, (key, value) => (key === "el" ? undefined : value)));
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

export function newChat() {
  const chat = {
    id: crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`,
    title: "New chat",
    system: "",
    model: settings.model,
    messages: [],
    created: Date.now(),
  };
  store.chats.unshift(chat);
  store.current = chat.id;
  save();
  return chat;
}

export const currentChat = () => store.chats.find((c) => c.id === store.current) || null;
// The served model a conversation talks to: the one chosen for it while the server serves it,
// else the server's default.
export const modelOf = (chat) => (session.models.includes(chat?.model) ? chat.model : session.models[0]);
// `path` asked of the model the current conversation talks to (the server's default without one).
export const forModel = (path, chat = currentChat()) => (modelOf(chat) ? `${path}?model=${encodeURIComponent(modelOf(chat))}` : path);
// What an entry's label names: a conversation here, or nothing known (the panel says "another
// client"; a conversation deleted here has its entries freed).
export const titleOf = (id) => store.chats.find((c) => c.id === id)?.title;

// The headers of a request to the server: JSON, and the API key given in Settings.
export function headers() {
  const h = { "Content-Type": "application/json" };
  if (settings.apiKey) h.Authorization = `Bearer ${settings.apiKey}`;
  return h;
}
