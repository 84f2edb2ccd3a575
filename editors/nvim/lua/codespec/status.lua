-- Progress ($/progress) and speculation stats (the schema's stats notification) for the statusline and
-- vim.notify.
local M = {}

-- The stats fields this module reads; setup() checks they are in the schema, so a renamed field fails
-- there (and in the tests) rather than showing "nil tok/s".
M.STATS_FIELDS = { "kind", "generated_tokens", "tokens_per_second", "tokens_per_forward", "acceptance" }

M.last_stats = nil -- params of the last stats notification
M.progress = nil -- { title, message, percentage } while a server task runs

local options = { notify_progress = true, notify_stats = false }

function M.configure(opts)
  options = opts
end

--- Errors naming the fields the schema lacks.
function M.check_schema(schema)
  local known = {}
  for _, name in ipairs(schema.notifications.stats.params) do
    known[name] = true
  end
  local missing = vim.tbl_filter(function(name)
    return not known[name]
  end, M.STATS_FIELDS)
  if #missing > 0 then
    error("codespec: the protocol's stats notification lacks " .. table.concat(missing, ", "), 0)
  end
end

--- "42.0 tok/s, 2.10 tok/fwd, 78% accepted (57 tokens)"
function M.format_stats(stats)
  return ("%.1f tok/s, %.2f tok/fwd, %d%% accepted (%d tokens)"):format(
    stats.tokens_per_second,
    stats.tokens_per_forward,
    math.floor(stats.acceptance * 100 + 0.5),
    stats.generated_tokens
  )
end

--- Handler for the stats notification.
function M.on_stats(_, params)
  M.last_stats = params
  if options.notify_stats then
    vim.notify(("codespec %s: %s"):format(params.kind, M.format_stats(params)), vim.log.levels.INFO)
  end
  vim.cmd.redrawstatus({ bang = true })
end

--- LspProgress autocmd callback (Neovim >= 0.10) for our client's $/progress.
function M.on_progress(value)
  if value.kind == "begin" then
    M.progress = { title = value.title or "codespec" }
    if options.notify_progress then
      vim.notify(M.progress.title .. "…", vim.log.levels.INFO)
    end
  end
  local progress = M.progress or { title = "codespec" }
  if value.kind == "end" then
    M.progress = nil
    if options.notify_progress then
      vim.notify(progress.title .. ": " .. (value.message or "done"), vim.log.levels.INFO)
    end
  else
    progress.message = value.message or progress.message
    progress.percentage = value.percentage or progress.percentage
    M.progress = progress
  end
  vim.cmd.redrawstatus({ bang = true })
end

--- For 'statusline' as %{v:lua.require'codespec'.statusline()} (plain text: a % here is not a statusline
--- item): the running task, else the last stats; "" before anything happened.
function M.statusline()
  local progress = M.progress
  if progress then
    local parts = { progress.title }
    if progress.message then
      table.insert(parts, progress.message)
    end
    if progress.percentage then
      table.insert(parts, progress.percentage .. "%")
    end
    return table.concat(parts, " ")
  end
  local stats = M.last_stats
  if stats then
    return ("codespec %.0f tok/s %d%% acc"):format(stats.tokens_per_second, math.floor(stats.acceptance * 100 + 0.5))
  end
  return ""
end

return M
